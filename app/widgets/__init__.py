"""The chat's widgets, one module each."""

from .chat_log import ChatLog
from .chat_message import ChatMessage
from .legend import Legend
from .load_bar import LoadBar
from .sparkline import TauSparkline
from .stats_panel import StatsPanel

__all__ = ["ChatLog", "ChatMessage", "Legend", "LoadBar", "StatsPanel", "TauSparkline"]
