"""The one exception type users need to catch."""


class GSSError(ValueError):
    """Bad input to gss: the message names the problem and how to fix it."""
