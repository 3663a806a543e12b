"""Modal screens: the key list and the drafter switch."""

from .drafter import DrafterChoice, DrafterScreen
from .help import HelpScreen

__all__ = ["DrafterChoice", "DrafterScreen", "HelpScreen"]
