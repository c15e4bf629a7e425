"""The help format of every specchat command (no model code: the stats command uses it too)."""

import argparse
import copy


class HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help, once: added where the help does not say it, also
    for an option given no help at all. An option whose default is None, empty or False says
    in its own help what happens without it."""

    def _format_action(self, action):
        # argparse skips the help column of an option without help, default and all.
        if not action.help and _shows_default(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _shows_default(action) -> bool:
    """Whether the default is a value worth printing: not None, "", False, [] or suppressed."""
    default = action.default
    return bool(action.option_strings) and default is not argparse.SUPPRESS \
        and default is not None and default is not False and default != "" and default != []
