"""One rank's optimizer step and its clock: precision and accumulation, learning-rate schedules,
evaluation that is right for any metric."""
