"""The role each worker kind plays in an RL experiment."""
