//! The manual: idem(1), made from the command line's own definitions (clap_mangen) with the
//! sections a manual page is expected to have that clap knows nothing of; and a page for each
//! command, which idem(1) refers to.

use std::io::Write;
use std::path::Path;

use super::args::Cli;

/// What a manual page has beyond the commands and their options, in roff.
const SECTIONS: &str = r#".SH ENVIRONMENT
.TP
\fBIDEM_CONFIG\fR
The configuration file, where a command takes \fB\-\-config\fR.
.TP
\fBIDEM_<TABLE>__<KEY>\fR
A key of a table of the configuration file, over the file: \fBIDEM_STORE__URL\fR, \fBIDEM_WORKER__LEASE=20s\fR. Precedence: a flag, then the environment, then the file, then the default.
.TP
\fBIDEM_LOG_FORMAT\fR
\fBtext\fR or \fBjson\fR, as \fB\-\-log\-format\fR.
.TP
\fBIDEM_ADMIN_URL\fR, \fBIDEM_ADMIN_TOKEN\fR, \fBIDEM_ADMIN_CA_FILE\fR
How the operator commands (\fBrequests\fR, \fBswitch\fR, \fBreload\fR) reach the admin API.
.TP
\fBRUST_LOG\fR
What is logged, as tracing's filter reads it (\fBinfo\fR by default).
.TP
\fBPGPASSWORD\fR
The password of a PostgreSQL store: never in the configuration file. Other secrets come from the variables the file names (\fBadmin_token_env\fR, \fBupstream_headers_env\fR).
.TP
\fBNOTIFY_SOCKET\fR
Set by systemd for a \fBType=notify\fR unit: \fBidem serve\fR says there when it is ready and when it stops.
.SH FILES
.TP
\fI/etc/idem/idem.toml\fR
The configuration, by convention; see \fBidem\-check\fR(1).
.TP
\fI/var/lib/idem/idem.db\fR
A SQLite store, with its \fI\-wal\fR and \fI\-shm\fR files beside it.
.TP
\fI/etc/idem/idem.env\fR
The service's secrets, read by the systemd unit.
.SH EXIT STATUS
.TP
\fB0\fR
Success: the broker stopped when asked, the configuration is valid, the operator's action was taken.
.TP
\fB1\fR
Failure, said on standard error in one line: a configuration refused (naming the key), a store that cannot be reached (naming the host and why), an address already in use, an admin API that refused the action (its problem's title and detail).
.TP
\fB2\fR
The command line itself was wrong.
.SH EXAMPLES
.nf
idem demo
idem check \-\-config /etc/idem/idem.toml \-\-connect
idem serve \-\-config /etc/idem/idem.toml
idem requests list \-\-state unknown \-\-route payments
idem requests resolve 0190a1b2\-\&... \-\-executed \-\-status 201 \-\-body '{"id":"ch_123"}'
idem switch set \-\-scope payments \-\-action retries_off \-\-reason "PSP incident"
idem reload
.fi
"#;

/// idem(1): the commands and options clap knows, then environment, files, exit status and
/// examples.
pub(super) fn page(out: &mut dyn Write) -> std::io::Result<()> {
    // Without clap's `help` command: it has no page of its own.
    let man = clap_mangen::Man::new(<Cli as clap::CommandFactory>::command().disable_help_subcommand(true));
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    man.render_options_section(out)?;
    man.render_subcommands_section(out)?;
    out.write_all(SECTIONS.as_bytes())?;
    man.render_version_section(out)
}

/// idem(1) and a page for each command it refers to (idem-serve(1), idem-requests-list(1), …)
/// in `dir`.
pub(super) fn pages(dir: &Path) -> std::io::Result<()> {
    clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), dir)?;
    let mut file = std::fs::File::create(dir.join("idem.1"))?;
    page(&mut file)?;
    file.flush()
}
