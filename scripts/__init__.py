"""Build and run helpers: the fixture, the images (images.py), the pods (kube_play.py, pod_scenario.py)."""
