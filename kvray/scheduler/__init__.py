"""WHO gets WHICH slot and WHAT runs this step (CPU only: no model, no collectives)."""

from kvray.scheduler.cache import CacheManager
from kvray.scheduler.prefill import PrefillAdder
from kvray.scheduler.scheduler import Scheduler, SchedulerStats
from kvray.scheduler.table import TableManager

__all__ = ["CacheManager", "PrefillAdder", "Scheduler", "SchedulerStats", "TableManager"]
