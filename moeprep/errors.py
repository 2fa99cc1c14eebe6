"""The one exception type for problems the user can fix (a bad path, a corrupt or foreign file, a bad option).

Library code raises MoeprepError("<file>: <what is wrong>; <what to do>"); moeprep/cli.py catches it once,
prints one line on stderr and exits 2. Anything else escaping is a bug and shows a traceback.
"""


class MoeprepError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""
