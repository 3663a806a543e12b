"""Draft-head models and their checkpoint formats (EAGLE, Medusa); drafting with them is in
``mlxspec.drafters``."""
