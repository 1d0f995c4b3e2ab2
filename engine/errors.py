"""User-facing errors: one line that says what is wrong and what to do."""


class MoechatError(Exception):
    """An error the user can act on. `str(err)` is the whole message, one line, no traceback."""


class CheckpointError(MoechatError):
    """A model directory that is missing, incomplete, corrupt or of an unsupported architecture."""


class BudgetError(MoechatError):
    """A memory budget that cannot hold what it is asked to hold."""


class RequestError(MoechatError):
    """A generation request that cannot be served as given (e.g. prompt longer than the context)."""


class ContextLengthError(RequestError):
    """A prompt longer than the context: `code` is the OpenAI API's, which clients read to trim a conversation."""

    code = "context_length_exceeded"


class Cancelled(MoechatError):
    """Work the user stopped before it finished (a calibration): nothing of it was saved."""


class NumericsError(MoechatError):
    """The model computed a NaN or infinite logit (float16 overflowing, or corrupt weights)."""
