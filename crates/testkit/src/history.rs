//! A history checker for critical sections: every holder records when it entered and left (on the
//! machine-wide monotonic clock, so several processes can share one history file) and its fencing
//! token; [`check`] reports any overlap and any token that is not greater than its predecessor's.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::time::{ClockId, clock_gettime};

/// Nanoseconds on `CLOCK_MONOTONIC`: comparable between processes on one machine.
pub fn now_ns() -> u64 {
    let ts = clock_gettime(ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An `Instant` of this process on the [`now_ns`] scale.
pub fn instant_ns(at: std::time::Instant) -> u64 {
    let (now, now_ns) = (std::time::Instant::now(), now_ns());
    if at <= now {
        now_ns.saturating_sub((now - at).as_nanos() as u64)
    } else {
        now_ns + (at - now).as_nanos() as u64
    }
}

/// One critical section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// Who held the lock (task or process id).
    pub holder: String,
    /// The fencing token it held.
    pub fence: u64,
    /// When it entered (after the acquisition returned), [`now_ns`].
    pub enter: u64,
    /// When it left (before the release was sent), [`now_ns`].
    pub leave: u64,
}

/// A history shared by tasks (in memory) and optionally by processes (a file every process
/// appends to).
#[derive(Debug, Default)]
pub struct History {
    sections: Mutex<Vec<Section>>,
    file: Option<(PathBuf, Mutex<File>)>,
}

/// An entered section; [`Open::leave`] records it.
#[derive(Debug)]
#[must_use]
pub struct Open<'a> {
    history: &'a History,
    holder: String,
    fence: u64,
    enter: u64,
}

impl Open<'_> {
    /// Records the section as left now.
    pub fn leave(self) -> Section {
        let now = now_ns();
        self.leave_at(now)
    }

    /// Records the section as ending at `leave` ([`now_ns`] scale), e.g. when the holder's
    /// lease could no longer be proven held, if that came before it left.
    pub fn leave_at(self, leave: u64) -> Section {
        let section = Section {
            holder: self.holder,
            fence: self.fence,
            enter: self.enter,
            leave: leave.max(self.enter),
        };
        self.history.record(section.clone());
        section
    }
}

impl History {
    /// An in-memory history.
    pub fn new() -> Self {
        History::default()
    }

    /// A history that also appends every section to `path` (shared by several processes).
    pub fn with_file(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(History {
            sections: Mutex::default(),
            file: Some((path, Mutex::new(file))),
        })
    }

    /// Enters a section now.
    pub fn enter(&self, holder: impl Into<String>, fence: u64) -> Open<'_> {
        Open {
            history: self,
            holder: holder.into(),
            fence,
            enter: now_ns(),
        }
    }

    /// Records a finished section.
    pub fn record(&self, section: Section) {
        if let Some((path, file)) = &self.file {
            let line = format!(
                "{} {} {} {}\n",
                section.holder, section.fence, section.enter, section.leave
            );
            // One short write on an O_APPEND file: lines from several processes do not interleave.
            file.lock()
                .unwrap()
                .write_all(line.as_bytes())
                .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
        }
        self.sections.lock().unwrap().push(section);
    }

    /// The sections recorded through this value.
    pub fn sections(&self) -> Vec<Section> {
        self.sections.lock().unwrap().clone()
    }

    /// Every section in a history file (from every process that wrote to it).
    pub fn read_file(path: impl AsRef<Path>) -> std::io::Result<Vec<Section>> {
        let file = File::open(path)?;
        let mut out = Vec::new();
        for line in BufReader::new(file).lines() {
            let line = line?;
            let parts: Vec<&str> = line.split_whitespace().collect();
            let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, line.clone());
            if parts.len() != 4 {
                return Err(bad());
            }
            out.push(Section {
                holder: parts[0].to_owned(),
                fence: parts[1].parse().map_err(|_| bad())?,
                enter: parts[2].parse().map_err(|_| bad())?,
                leave: parts[3].parse().map_err(|_| bad())?,
            });
        }
        Ok(out)
    }
}

/// What a clean history contained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Critical sections checked.
    pub sections: usize,
    /// Distinct holders among them.
    pub holders: usize,
}

/// Checks mutual exclusion and fencing: ordered by entry, no section may begin before every
/// earlier one has left, and every fencing token must be greater than the one before it.
/// Returns a description of the first violation.
pub fn check(sections: &[Section]) -> Result<Report, String> {
    let mut sorted: Vec<&Section> = sections.iter().collect();
    sorted.sort_by_key(|s| (s.enter, s.leave));
    let mut latest: Option<&Section> = None;
    for pair in sorted.windows(2) {
        if pair[1].fence <= pair[0].fence {
            return Err(format!(
                "fencing token did not increase: {:?} then {:?}",
                pair[0], pair[1]
            ));
        }
    }
    for section in &sorted {
        if section.leave < section.enter {
            return Err(format!("section leaves before it enters: {section:?}"));
        }
        if let Some(prev) = latest
            && section.enter < prev.leave
        {
            return Err(format!(
                "two holders at once: {prev:?} overlaps {section:?} by {} ns",
                prev.leave - section.enter
            ));
        }
        if latest.is_none_or(|p| section.leave > p.leave) {
            latest = Some(section);
        }
    }
    let holders: std::collections::HashSet<&str> =
        sorted.iter().map(|s| s.holder.as_str()).collect();
    Ok(Report {
        sections: sorted.len(),
        holders: holders.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(holder: &str, fence: u64, enter: u64, leave: u64) -> Section {
        Section {
            holder: holder.into(),
            fence,
            enter,
            leave,
        }
    }

    #[test]
    fn accepts_a_clean_history_and_rejects_overlap_and_bad_fences() {
        let clean = [s("a", 1, 0, 10), s("b", 2, 10, 20), s("a", 3, 25, 30)];
        assert_eq!(
            check(&clean).unwrap(),
            Report {
                sections: 3,
                holders: 2
            }
        );
        let overlap = [s("a", 1, 0, 10), s("b", 2, 9, 20)];
        assert!(check(&overlap).unwrap_err().contains("two holders"));
        // Overlap with a long section that is not the immediate predecessor.
        let nested = [s("a", 1, 0, 100), s("b", 2, 100, 110), s("c", 3, 50, 60)];
        assert!(check(&nested).is_err());
        let fences = [s("a", 2, 0, 10), s("b", 2, 10, 20)];
        assert!(check(&fences).unwrap_err().contains("fencing"));
    }

    #[test]
    fn file_histories_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        let h = History::with_file(&path).unwrap();
        h.enter("p1", 1).leave();
        h.enter("p2", 2).leave();
        let read = History::read_file(&path).unwrap();
        assert_eq!(read, h.sections());
        assert!(check(&read).is_ok());
    }
}
