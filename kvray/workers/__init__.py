"""Per-GPU workers: model shard + KV pool + attention backend; they execute StepPlans."""
