"""Training on the papers' tasks: ``clusterformer train`` / ``clusterformer eval``."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from .loop import evaluate_checkpoint, load_trained, run_training
from .tasks import (
    TASK_SPECS,
    TASKS,
    Batch,
    ClassificationTask,
    Examples,
    LanguageModelTask,
    Task,
    TaskSpec,
    prepare_task,
    ranking_metrics,
)

__all__ = [
    "TASKS",
    "TASK_SPECS",
    "Batch",
    "ClassificationTask",
    "DataConfig",
    "Examples",
    "LanguageModelTask",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "Task",
    "TaskSpec",
    "TrainConfig",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_trained",
    "prepare_task",
    "ranking_metrics",
    "run_training",
    "save_checkpoint",
]
