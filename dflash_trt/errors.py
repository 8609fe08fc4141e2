"""The one exception type users see: the CLI turns it into a single message and exit code 2."""


class DFlashTrtError(Exception):
    """Bad input or an impossible request, explained in one sentence."""
