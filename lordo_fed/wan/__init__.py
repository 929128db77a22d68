"""Wide-area links: link rates and the link-bound ideal round time (`links`), and the emulation of
a geo-distributed deployment on one machine, with network namespaces and shaped links (`netns`,
`emulate`, the `lordo-emulate` command). Neither torch nor Flower is imported here."""
