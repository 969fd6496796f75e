//! Times and durations as people write them (command flags, admin API fields) and as
//! fleetgate shows them: a duration is a whole number and a unit (`90s`, `15m`, `2h`,
//! `30d`), a time is an RFC 3339 date-time (`2027-01-01T00:00:00Z`,
//! `2027-01-01T01:00:00+01:00`, seconds and a fraction optional) or a UTC day
//! (`2027-01-01`). Both are whole Unix seconds here: key expiries and grace periods,
//! like every time the store keeps, need no finer grain.

/// Seconds in a day, the largest unit of a duration.
const DAY: u64 = 86_400;

/// The seconds of a duration: `0`, or digits and a unit (`s`, `m`, `h`, `d`). `None`
/// for anything else (a sign, a fraction, another unit, an overflow).
pub fn parse_duration(value: &str) -> Option<u64> {
    if value == "0" {
        return Some(0);
    }
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let unit_secs = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => DAY,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(unit_secs)
}

/// A duration as [`parse_duration`] reads it, in its largest whole unit (`90s`, `15m`,
/// `1d`).
pub fn format_duration(secs: u64) -> String {
    match secs {
        0 => "0s".to_owned(),
        s if s % DAY == 0 => format!("{}d", s / DAY),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// The Unix seconds of an RFC 3339 date-time (a fraction of a second is dropped) or of
/// a UTC day's start; `None` for anything else.
pub fn parse_time(value: &str) -> Option<i64> {
    let (date, clock) = match value.find(['T', 't', ' ']) {
        Some(at) => (&value[..at], Some(&value[at + 1..])),
        None => (value, None),
    };
    let date = parse_date(date)?;
    let Some(clock) = clock else {
        return Some(date.midnight().assume_utc().unix_timestamp());
    };
    let (clock, offset_secs) = split_offset(clock)?;
    let mut parts = clock.splitn(3, ':');
    let hour = two_digits(parts.next()?)?;
    let minute = two_digits(parts.next()?)?;
    let second = match parts.next() {
        None => 0,
        Some(seconds) => {
            let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, "0"));
            if fraction.is_empty() || !fraction.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            two_digits(whole)?
        }
    };
    let at = date.with_hms(hour, minute, second).ok()?.assume_utc();
    Some(at.unix_timestamp() - offset_secs)
}

/// `2027-01-01T00:00:00Z`; the number itself for a time outside years 0 to 9999.
pub fn format_time(unix_secs: i64) -> String {
    match time::OffsetDateTime::from_unix_timestamp(unix_secs) {
        Ok(at) if (0..=9999).contains(&at.year()) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            at.year(),
            u8::from(at.month()),
            at.day(),
            at.hour(),
            at.minute(),
            at.second()
        ),
        _ => unix_secs.to_string(),
    }
}

/// `YYYY-MM-DD`.
fn parse_date(date: &str) -> Option<time::Date> {
    let (year, rest) = date.split_once('-')?;
    let (month, day) = rest.split_once('-')?;
    if year.len() != 4 || !year.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let month = time::Month::try_from(two_digits(month)?).ok()?;
    time::Date::from_calendar_date(year.parse().ok()?, month, two_digits(day)?).ok()
}

/// The clock of a time and its offset from UTC in seconds (`Z`, `+HH:MM`, `-HH:MM`).
fn split_offset(clock: &str) -> Option<(&str, i64)> {
    if let Some(clock) = clock.strip_suffix(['Z', 'z']) {
        return Some((clock, 0));
    }
    let at = clock.rfind(['+', '-'])?;
    let (clock, offset) = clock.split_at(at);
    let sign = if offset.starts_with('-') { -1 } else { 1 };
    let (hours, minutes) = offset[1..].split_once(':')?;
    let (hours, minutes) = (two_digits(hours)?, two_digits(minutes)?);
    if hours > 23 || minutes > 59 {
        return None;
    }
    Some((
        clock,
        sign * (i64::from(hours) * 3_600 + i64::from(minutes) * 60),
    ))
}

/// Exactly two ASCII digits.
fn two_digits(text: &str) -> Option<u8> {
    (text.len() == 2 && text.bytes().all(|b| b.is_ascii_digit()))
        .then(|| text.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        for (text, secs) in [
            ("0", 0),
            ("0s", 0),
            ("90s", 90),
            ("15m", 900),
            ("2h", 7_200),
            ("30d", 2_592_000),
        ] {
            assert_eq!(parse_duration(text), Some(secs), "{text}");
        }
        for bad in [
            "", "s", "h", "-1d", "+1d", "1.5h", "3w", "1 h", "24", "1h30m", "é",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
        assert_eq!(parse_duration("99999999999999999999d"), None);
        assert_eq!(parse_duration("213503982334602d"), None, "overflow");
        for (secs, text) in [(0, "0s"), (90, "90s"), (900, "15m"), (7_200, "2h")] {
            assert_eq!(format_duration(secs), text);
        }
        assert_eq!(format_duration(86_400), "1d");
    }

    #[test]
    fn rfc_3339_times_and_days() {
        const AT: i64 = 1_764_672_000; // 2025-12-02T10:40:00Z
        for text in [
            "2025-12-02T10:40:00Z",
            "2025-12-02T10:40Z",
            "2025-12-02t10:40:00z",
            "2025-12-02 10:40:00Z",
            "2025-12-02T10:40:00.999Z",
            "2025-12-02T11:40:00+01:00",
            "2025-12-02T05:10:00-05:30",
        ] {
            assert_eq!(parse_time(text), Some(AT), "{text}");
        }
        assert_eq!(parse_time("2025-12-02"), Some(1_764_633_600));
        for bad in [
            "",
            "2025-12-02T10:40",
            "2025-13-01",
            "2025-02-30",
            "25-12-02",
            "2025-12-02T25:00:00Z",
            "2025-12-02T10:40:00+24:00",
            "2025-12-02T10:40:00.Z",
            "2025-12-02T10:40:00+0100",
            "yesterday",
            "1764672000",
        ] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
        assert_eq!(format_time(AT), "2025-12-02T10:40:00Z");
        assert_eq!(parse_time(&format_time(AT)), Some(AT));
        assert_eq!(format_time(i64::MAX), i64::MAX.to_string());
    }
}
