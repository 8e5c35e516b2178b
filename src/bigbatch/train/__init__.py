"""`bigbatch train`: contrastive dual-encoder training end to end (data, model, loop, checkpoints).

* :mod:`.data` -- built-in (docstring, code) pairs extracted with ``ast``; user JSONL.
* :mod:`.tokenizer`, :mod:`.model` -- hashed embedding-bag encoder; Hugging Face encoders.
* :mod:`.loop` -- :class:`TrainConfig` and :func:`train` (GradCache steps, eval, resume).
* :mod:`.checkpoint`, :mod:`.metrics`, :mod:`.plot` -- outputs of a run.
"""

from .loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
