"""TensorFlow parameter-server training under DLRover (docs/tensorflow.md): the strategy and
coordinator built from TF_CONFIG, a training loop that leases data shards from the master and
survives a lost worker (TensorFlow re-runs its steps) and a lost ps (restore the latest
checkpoint once the master says the ps serves again). TensorFlow is imported only by the
modules that need it, never by importing this package."""
