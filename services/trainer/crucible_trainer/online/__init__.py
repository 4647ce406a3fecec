"""The online training job: the loop every online method shares (`train`), its steps when
rollouts overlap the update (`overlapped`), checkpoints and exact resume (`checkpoint`) and the
learning curves drawn from its metrics (`curves`)."""
