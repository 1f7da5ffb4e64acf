"""A session plan as Kubernetes resources: kubernetes-sigs/agent-sandbox's v1beta1 kinds, a pod whose
supervisor is ``agentcell session start``. :mod:`.render` makes the resources (plain data, no I/O);
:mod:`.image` the container image's recipe. Nothing here talks to a cluster: ``kubectl apply`` or the
``k8s-agent-sandbox`` client does.
"""
