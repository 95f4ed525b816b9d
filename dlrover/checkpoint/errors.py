"""Exception hierarchy of the flash-checkpoint subsystem."""


class CheckpointError(Exception):
    """Base class of every error raised by dlrover.checkpoint."""


class ShmSpaceError(CheckpointError):
    """/dev/shm has too little free space for a checkpoint segment."""

    def __init__(self, path: str, needed: int, free: int) -> None:
        self.path = path
        self.needed = needed
        self.free = free
        super().__init__(
            f"shared memory {path!r} needs {needed} bytes ({needed / 2**30:.2f} GiB) more but "
            f"only {free} bytes ({free / 2**30:.2f} GiB) are free. Enlarge /dev/shm: "
            "`docker run --shm-size=<size>`, a Kubernetes emptyDir with `medium: Memory` "
            "mounted at /dev/shm, or `mount -o remount,size=<size> /dev/shm`; or point "
            "DLROVER_CKPT_SHM_DIR at a larger tmpfs, or DLROVER_CKPT_SPILL_DIR at a local folder "
            "with room (a saver's buffers that do not fit go there); or save less state "
            "(each saving rank keeps two buffers; DLROVER_CKPT_BUFFERS=1 keeps one, and a save "
            "then waits for the persist of the step before)."
        )


class StateDictError(CheckpointError):
    """A state dict holds a value that a flash checkpoint cannot store."""


class SegmentStateError(CheckpointError):
    """A shared segment holds no complete checkpoint (empty, or a copy was torn)."""


class CheckpointStorageError(CheckpointError):
    """Storage cannot be written or read (permissions, missing path, I/O error)."""


class CheckpointCorruptError(CheckpointError):
    """A persisted step fails its manifest check (missing file, wrong size or checksum)."""


class SaverError(CheckpointError):
    """The checkpoint saver refused a request or cannot be reached."""
