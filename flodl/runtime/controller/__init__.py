"""What the controller decides: which rank trains what in each window, what the reports mean
(ElChe, aggregation), who is still a member, when and how a checkpoint is taken."""
