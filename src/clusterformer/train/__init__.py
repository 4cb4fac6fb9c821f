"""Training on the papers' tasks: ``clusterformer train`` / ``clusterformer eval``."""

from .checkpoint import load_checkpoint, save_checkpoint
from .loop import TrainConfig, evaluate_checkpoint, load_trained, run_training
from .tasks import TASKS, Batch, ClassificationTask, Examples, LanguageModelTask, Task, prepare_task, ranking_metrics

__all__ = [
    "TASKS",
    "Batch",
    "ClassificationTask",
    "Examples",
    "LanguageModelTask",
    "Task",
    "TrainConfig",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_trained",
    "prepare_task",
    "ranking_metrics",
    "run_training",
    "save_checkpoint",
]
