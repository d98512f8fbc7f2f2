"""Safe file I/O, one concern: `guarded` (deletes and replacements confined to real paths below a root, the one
atomic single-file write, every writer's environment error as one line), `files` (atomic text and JSON, shares of
files to hash), `safeio` (weights-only loading, the restricted unpickler, the bounds of a torch zip file) and
`records` (JSON records read back from disk, checked field by field)."""
