"""Example model configs, cluster examples and plans; installed as data under ``moeplan.examples``."""
