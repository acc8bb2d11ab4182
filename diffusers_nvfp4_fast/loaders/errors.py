"""The one error every loader raises for a checkpoint it refuses."""


class NVFP4CheckpointError(ValueError):
    """A checkpoint that does not match the model it claims to be, or is unsafe to load; the message lists every
    problem found (file, key, shape, dtype, value) and, where there is one, the argument that resolves it."""
