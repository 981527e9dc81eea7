"""The one exception type users need to catch, and the one warning type they may filter."""


class GSSError(ValueError):
    """Bad input to gss: the message names the problem and how to fix it."""


class GSSWarning(UserWarning):
    """gss went on but the result may not be what you meant (a solve that did not settle, an
    artifact attached to a model it was not made for with ``strict=False``); filter it with
    ``warnings.filterwarnings("ignore", category=gss.GSSWarning)``."""
