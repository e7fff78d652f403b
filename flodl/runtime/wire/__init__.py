"""How the launcher and the ranks talk: authenticated frames on a socket, bulk tensors through
shared memory or streamed, the message types, and the data plane's rendezvous store."""
