"""Running a step's plan on the model: executors, the plan that crosses to them, CUDA graphs."""
