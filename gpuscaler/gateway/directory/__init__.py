"""Who the workloads are: pods and ScaledObjects, from the Kubernetes API or a file."""
