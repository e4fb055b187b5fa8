-- One row that the store rewrites, after its database was lost under it (an I/O error, a full
-- disk, a file moved away and back), to find out whether the database takes writes again.
CREATE TABLE liveness (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    written_at INTEGER NOT NULL
);
