"""Online RL: rollouts from the generator, rewards from the sandbox, updates of the LoRA policy."""
