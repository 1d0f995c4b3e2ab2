"""User-facing errors: one line that says what is wrong and what to do."""
import sys

# the installer a line tells a user to run again (a CUDA build of PyTorch, a fresh environment): this OS's
INSTALLER = r"installer\install.ps1" if sys.platform == "win32" else "installer/install.sh"


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


def out_of_vram(err: BaseException, remedy: str = "") -> str:
    """The line for an allocation the GPU refused (torch's OutOfMemoryError, the driver's "CUDA error: out of memory"), ""
    for any other error; `remedy` replaces the run's advice (its flags) for a caller that takes none. After a load sized its
    share of the free VRAM, another program (a game, a browser) took some, or a pass needed more than the margin kept."""
    text = str(err).strip()
    if type(err).__name__ != "OutOfMemoryError" and "CUDA out of memory" not in text and "CUDA error: out of memory" not in text:
        return ""
    said = ". ".join(text.splitlines()[0].split(". ")[:2]) if text else type(err).__name__  # what ran out, what was asked
    return f"the GPU is out of memory ({said}): " + (remedy or "close programs that use it (a game, a browser's hardware "
                                                     "acceleration), or leave moechat less of it: a lower "
                                                     "--vram-budget-gib, --expert-cache-ratio or --context-len")
