"""Running beyond one machine on the engines users already have: torch elastic across nodes
(nodes.py), Slurm batch scripts (slurm.py) and Kubeflow PyTorchJob manifests (k8s.py)."""
