"""Request files -> validated Request objects: fields, generation modes, actions."""
