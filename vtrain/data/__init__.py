"""Data: built-in demo sets, folder datasets, the resumable sharded sampler."""
