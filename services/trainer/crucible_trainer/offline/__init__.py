"""Offline learning: the candidate pipeline and the SFT / DPO methods (TRL).

* `pipeline.py`: the `pipeline` job, a driver of named stages (baseline, generate, annotate,
  build, train, merge, evaluate, analyze) over one run dir, skipping stages whose inputs are
  unchanged (`stages.py`).
* `sampling.py`, `annotate.py`, `build.py`, `analysis.py`: what the data stages compute.
* `trl_train.py`: SFT and DPO with TRL's trainers on LoRA, wired to the job channel (progress,
  cancel, checkpoints, resume); `job.py` runs it as a standalone `train` job on a user's JSONL.
* `merge.py`: the adapter folded into a standalone model directory.
"""
