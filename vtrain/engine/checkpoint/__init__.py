"""The checkpoint subsystem of a training run, one module per concern:

- `format`: the layout names (defined once), the manifest (`COMPLETE`), `train_state.json` (`TrainState`), verify,
  find, stage, commit and prune: what a checkpoint is on disk;
- `layout`: what each engine keeps of its own in a checkpoint (the reader asks the layout of the engine that wrote
  it);
- `checkpointer`: the protocol of a run (which rank does what, and when): choosing what to resume, the write
  sequence, the read sequence;
- `content` and `content_state`: what a checkpoint's tensors, optimizer moments and RNG states must be, the one
  check every reader uses;
- `best`: the --keep-best record;
- `resume_settings`: the training settings a resume changes from its checkpoint's, applied and said.
"""
