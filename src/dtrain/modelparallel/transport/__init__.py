"""Messages between the ranks of one pipeline group: what travels (:mod:`.message`), the
nested values it carries (:mod:`.structure`), and the byte streams over gloo (:mod:`.wire`)."""
