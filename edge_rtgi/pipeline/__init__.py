"""Pipelines: YAML chains of stages (config), the protocol-neutral session core (session),
the stages themselves (stages/) and the models they share (resources). See docs/daemon.md."""
