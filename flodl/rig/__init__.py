"""The CPU rig's models of what makes consumer rigs unequal: speed (``pacing``: deadline-paced
steps) and links (``links``: what moving bytes costs on PCIe without P2P or Ethernet)."""
