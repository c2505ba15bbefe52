"""The one error type for GGUF files, shared by the header reader, the model file and the checks
of metadata values and tensor data."""


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file; the message names the file and the problem."""
