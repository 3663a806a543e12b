"""The mlxspec terminal chat (Textual). Started by ``mlxspec chat``."""
