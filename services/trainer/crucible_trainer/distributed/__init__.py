"""One train job over several ranks on `torch.distributed` (spec: `crucible_shared.distributed`).

* `launch.py`: the worker starts the ranks with `torchrun`, waits, and reports (a dead rank fails
  the job naming it; the worker's stop becomes rank 0's checkpoint-and-requeue).
* `standby.py`: the `torchrun` group itself, started before its job (its ranks' cold start taken,
  waiting for the job's file) or for it.
* `rank.py`: one rank's entry point: rank 0 leads (`leader.LeaderRun`, the job loop of `online/train.py`),
  the others follow its commands (`ranks.py`).
* `parallel.py`: each rank's share of the update and the gradient reduction (DDP or FSDP2).

Rollouts are generated once per step, by rank 0 (from the generator replicas, as in one process);
the batch is broadcast to every rank with the update command and each rank trains on its share,
the normaliser being the whole batch's.
"""
