"""Job plumbing shared by every kind of job: the queued job's entry (`entry`), the runner registry
(`runners`), the run base every runner extends (`jobrun`), the job's channel to Redis and its
fenced outbox (`channel`, `outbox`), cancellation (`cancel`), where a job's story is written
(`sink`: events, metrics, rollouts, W&B), outputs that appear atomically (`atomic`) and what a
job leaves to the machine (`hardware`)."""
