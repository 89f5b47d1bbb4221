"""Reading and checking the training config: DeepSpeed's JSON -> frozen dataclasses, one per section.

``read_config`` (``offload.config.read``) is the one reader; each section's dataclass lives in
``offload.config.sections`` with its field checks (``checks``) and the checks across sections
(``combos``); ``keys`` lists which DeepSpeed keys exist and which the engine acts on. A script's own
optimizer handed to ``initialize(optimizer=...)`` is read as the optimizer section
(``client_optimizer``), and DeepSpeed's LR schedules become torch schedulers (``schedulers``).
"""
from offload.config.read import *  # noqa: F401,F403
from offload.config.read import __all__  # noqa: F401
