"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, files, options). Never a bug in emapg.

    The CLI catches it at the top level, prints ``error: <message>`` on one line
    and exits with code 2 without a traceback.
    """


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most `limit` characters (for one-line errors)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: How the operating system says a write failed for want of room, as libraries with I/O of their own (safetensors'
#: Rust writer) quote it in an error that is no OSError.
WRITE_FAILURES = ("No space left on device", "Disk quota exceeded", "File too large")


def write_failure(exc: BaseException) -> "str | None":
    """The reason when `exc` reports a write that failed for want of room (a full disk, a quota or file-size limit)."""
    return next((why for why in WRITE_FAILURES if why in str(exc)), None)
