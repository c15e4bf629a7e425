"""The help format of every specchat command (no model code: the stats command uses it too)."""

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help, once: added where the help does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text.lower() or default is None \
                or default is False or default == [] or default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
