"""The translator's tools beside the pure configuration path: what the CLI does with a Plan (cluster job files for
Slurm and Kubernetes, SageMaker's paths, the launch environment under Slurm, diagrams, the traffic and
model-state estimates, the machine doctor and the generated configuration reference). Each module is pure Python
and reads the Plan; nothing in the pure path (load, validate, normalize, plan) imports them."""
