"""The data package's one error class for inputs a user can fix."""


class DataInputError(ValueError):
    """Unusable data: a missing, empty or damaged file, a bad ``--split`` or blend, token ids the
    model cannot embed, a tokenizer file that is not one. The message names the flag or file,
    the value and the fix; entry points print it as one ``error:`` line and exit 2."""
