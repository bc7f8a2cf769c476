-- Gate deals, version 80: the waiting room's logo for the buyer page
-- (docs/waiting-room.md, "The shop's look").
--
-- The room's page may carry a logo of up to 32 KiB, as a data: URL
-- ("data:image/png;base64,…", webp or svg+xml): at most 43,718 ASCII characters,
-- too long for the room's own column (waiting_room, 4096 characters, read with every
-- deal row). So it lives here, written with waiting_room in the same statement and
-- read only by the buyer page's config read (once per logo and process); the room's
-- JSON names it by its SHA-256. NULL: no logo.

ALTER TABLE deals ADD COLUMN IF NOT EXISTS room_logo TEXT CHARACTER SET ascii NULL AFTER room_seed;
