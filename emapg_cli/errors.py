"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, files, options). Never a bug in emapg.

    The CLI catches it at the top level, prints ``error: <message>`` on one line
    and exits with code 2 without a traceback.
    """
