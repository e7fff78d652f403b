"""The CPU rig's models of what makes consumer rigs unequal: speed (``pacing``: deadline-paced
steps), memory (``memory``: a simulated device that runs out as a GPU does) and links
(``links``: what moving bytes costs on PCIe without P2P or Ethernet)."""
