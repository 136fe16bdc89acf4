"""Compiler passes, one per file (docs/architecture.md §4); installed as ``moeplan.passes``."""
from moeplan.passes.partition_stages import PartitionStagesPass
from moeplan.passes.place_experts import PlaceExpertsPass
from moeplan.passes.plan_memory import PlanMemoryPass
from moeplan.passes.schedule import SchedulePass
from moeplan.passes.shard import ShardPass
from moeplan.passes.simulate import SimulatePass

ALL_PASSES = (ShardPass, PartitionStagesPass, PlaceExpertsPass, PlanMemoryPass, SchedulePass, SimulatePass)
