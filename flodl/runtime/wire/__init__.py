"""How the launcher and the ranks talk: what the launcher hands a rank (the frozen job spec,
``job_spec``; its role in the environment, read only in ``rank_env``; the test-only faults both
sides arm from it, ``chaos``), a rank's link to the controller (``rank_link``), authenticated
frames on a socket, bulk tensors through shared memory or streamed, the message types, and the
data plane's rendezvous store. Both sides import this folder; it imports neither."""
