"""`asynctron demo`: a small GPT trained on local gloo ranks with every part of asynctron
(preprocess, the async loader, awaitable gradient buckets, async checkpoints), interrupted and
resumed, checked bit for bit against an uninterrupted run."""

from asynctron._demo._corpus import write_corpus
from asynctron._demo._job import DemoReport, run_demo
from asynctron._demo._model import TinyGPT, language_model_loss
from asynctron._demo._output import disk_nbytes, fresh_output_dir, remove_output_dir
from asynctron._demo._trainer import DemoConfig, RunReport, TieredCheckpoints, dataset, train

__all__ = ["DemoConfig", "DemoReport", "RunReport", "TieredCheckpoints", "TinyGPT", "dataset",
           "disk_nbytes", "fresh_output_dir", "language_model_loss", "remove_output_dir",
           "run_demo", "train", "write_corpus"]
